//! When the poller calls each worker's event endpoint, and what it makes of a reply. Pure: the
//! adapter (`proxy::poller`) sends the calls and feeds the replies back.
//!
//! Per worker, at most one call is in flight. A call whose reply never arrives frees its worker
//! after the call's timeout plus a margin. After a reply:
//! * applied, with events and more waiting (a full page): poll again at once (a page that claims
//!   more but carries nothing is no progress: the interval applies);
//! * long polling (`events.long_poll_ms > 0`): poll again at once after a dump and after any
//!   applied page that carried events or that the worker held for at least half the wait, so the
//!   next event is routable as soon as it exists; an empty page that came back early means the
//!   endpoint does not hold calls, and the plain interval applies (no busy loop against it);
//! * a gap: the next call is the dump, at once for the first gap since the last applied page;
//!   a second one (the dump did not close it) counts as a rejection and backs off, so a worker
//!   whose dump never matches its buffer is not re-dumped at network speed;
//! * plain polling: after `events.poll_interval_ms`;
//! * failed (no answer, not 200): after the interval;
//! * rejected (malformed, oversized, wrong block size, absurd ids): after an exponential backoff,
//!   `poll_interval_ms * 2^n` for the n-th rejection since the last applied page, at most
//!   [`MAX_BACKOFF_MS`], so a worker whose dump is too large is not re-fetched every interval
//!   forever.

use crate::config::EventsConfig;
use crate::events::Booked;
use crate::events::EventPage;

/// Longest pause between two polls of a worker whose replies keep being rejected.
pub const MAX_BACKOFF_MS: u64 = 30_000;
/// How long past its timeout a call counts as in flight (Envoy answers timed-out calls itself).
const LOST_CALL_MARGIN_MS: u64 = 1000;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CallKind {
    /// `GET <events.path>?after=<cursor>` (`&wait_ms=` when long polling).
    Events { after: u64 },
    /// `GET <events.dump_path>`: the worker's whole cache.
    Dump,
}

/// The request path of a call. `declare`: this Envoy's router id and what it has booked on
/// the worker, sent with every events call (`&router=<hex id>&booked=<requests>,<tokens>,<blocks>`)
/// so that a bridge relays it to the other routers polling the worker
/// ([`crate::load_store::router_id`]).
pub fn call_path(events: &EventsConfig, kind: CallKind, declare: Option<(u64, Booked)>) -> String {
    match kind {
        CallKind::Events { after } => {
            let sep = if events.path.contains('?') { '&' } else { '?' };
            let (limit, max_bytes) = (events.page_events, page_max_bytes(events));
            let mut path = format!(
                "{}{sep}after={after}&limit={limit}&max_bytes={max_bytes}",
                events.path
            );
            if events.long_poll_ms > 0 {
                path.push_str(&format!("&wait_ms={}", events.long_poll_ms));
            }
            if let Some((router, booked)) = declare {
                path.push('&');
                path.push_str(&declaration_query(router, &booked));
            }
            path
        }
        CallKind::Dump => events.dump_path.clone(),
    }
}

/// `router=<hex id>&booked=<requests>,<tokens>,<blocks>`, and `&timing=<seven sums>` when the
/// Envoy learns the worker's timing.
fn declaration_query(router: u64, booked: &Booked) -> String {
    let mut query = format!("router={router:016x}&booked={}", booked.query_value());
    if let Some(t) = &booked.timing {
        query.push_str("&timing=");
        query.push_str(&t.query_value());
    }
    query
}

/// The path of a declaration between polls (`POST`): `None` when `events.declare_path` is
/// empty. Sent when the bookings [`Booked::moved_from`] the last declared (see
/// [`Declarations`]).
pub fn declare_path(events: &EventsConfig, router: u64, booked: &Booked) -> Option<String> {
    if events.declare_path.is_empty() {
        return None;
    }
    let sep = if events.declare_path.contains('?') {
        '&'
    } else {
        '?'
    };
    let query = declaration_query(router, booked);
    Some(format!("{}{sep}{query}", events.declare_path))
}

/// Per worker, what this Envoy last declared to its bridge and whether a declaration call is in
/// flight: a declaration between polls is sent when the bookings moved since, one at a time.
#[derive(Clone, Debug, Default)]
pub struct Declarations {
    last: Vec<Option<Booked>>,
    in_flight: Vec<bool>,
    /// Workers whose event endpoint has no declaration path (it answered 404, 405 or 501: not
    /// `kv-event-bridge`): they hear declarations with the polls only.
    unsupported: Vec<bool>,
}

impl Declarations {
    /// Records that `booked` went out to `worker`'s bridge (with a poll, or a declaration call:
    /// `call`, which is then in flight until [`Self::answered`]).
    pub fn sent(&mut self, worker: u16, booked: Booked, call: bool) {
        let i = usize::from(worker);
        if self.last.len() <= i {
            self.last.resize(i + 1, None);
            self.in_flight.resize(i + 1, false);
            self.unsupported.resize(i + 1, false);
        }
        if let (Some(l), Some(f)) = (self.last.get_mut(i), self.in_flight.get_mut(i)) {
            *l = Some(booked);
            *f |= call;
        }
    }

    /// The declaration call to `worker` was answered with `status` (`None`: no answer). An
    /// endpoint without the path is not asked again (until [`Self::forget`]).
    pub fn answered(&mut self, worker: u16, status: Option<&str>) {
        let i = usize::from(worker);
        if let Some(f) = self.in_flight.get_mut(i) {
            *f = false;
        }
        if matches!(status, Some("404" | "405" | "501")) {
            if let Some(u) = self.unsupported.get_mut(i) {
                *u = true;
            }
        }
    }

    /// `worker`'s entry has a new occupant: nothing was declared to it yet.
    pub fn forget(&mut self, worker: u16) {
        let i = usize::from(worker);
        if let Some(x) = self.in_flight.get_mut(i) {
            *x = false;
        }
        if let Some(x) = self.unsupported.get_mut(i) {
            *x = false;
        }
        if let Some(l) = self.last.get_mut(i) {
            *l = None;
        }
    }

    /// Whether `now` should be declared to `worker`'s bridge before the next poll: it moved from
    /// what was last declared and no declaration call is in flight. Never before a first
    /// declaration with a poll (the bridge does not know this Envoy yet).
    pub fn due(&self, worker: u16, now: &Booked) -> bool {
        let i = usize::from(worker);
        match (
            self.last.get(i),
            self.in_flight.get(i),
            self.unsupported.get(i),
        ) {
            (Some(Some(last)), Some(false), Some(false)) => now.moved_from(last),
            _ => false,
        }
    }
}

/// The most event bytes the poller asks a page to hold, whatever `max_response_bytes` allows:
/// a page's body, its parse and its log batch pass through the VMs' linear memory, which never
/// shrinks, so larger pages raise every replica's memory for good. With 1 MiB pages each
/// replica kept 0.3-1 MiB more linear memory and ~0.5 MiB more outside it (Envoy's per-thread
/// copies of the batch values) than its index needs. With 256 KiB (log batches of ~26 KiB in
/// `benches/envoy_memory.rs`, whose events are 500 blocks, ~80 KiB of JSON), 0.12-0.15 MiB more
/// linear memory (holes the batch copies leave between index chunks) and 0-0.5 MiB more in
/// Envoy's heap (tcmalloc's thread caches kept ~0.1 MiB of freed batch copies per thread):
/// 39.1-44.3 B per entry per replica at 100k entries over eleven runs. With 128 KiB (batches of
/// ~13 KiB there) ~0.05 MiB and ~0: 37.6-37.7 B (with the entry chunk cut at the bound, 0.7 B of
/// it, `index::pool`), and 64 KiB saved no more linear memory. 128 KiB still holds two of the
/// largest vLLM events (~50 KiB of JSON with their token ids); the poller makes twice as many
/// calls for a backlog: events applied inside Envoy (`benches/envoy_cpu.rs -- --only events`)
/// 209-390 k/s per replica, median 252k, against 204-406 k/s, median 343k, with 256 KiB
/// (five runs each, alternating, a loaded 2-core machine; docs/history/benchmark-log.md).
pub const PAGE_MAX_BYTES: usize = 1 << 17;

/// The event bytes a page may hold (`&max_bytes=`): [`PAGE_MAX_BYTES`], or 7/8 of
/// `events.max_response_bytes` if less (the rest left for the page's other fields, load and the
/// worker's description, so a page the worker filled to the brim is not refused as oversized).
pub fn page_max_bytes(events: &EventsConfig) -> usize {
    (events.max_response_bytes - events.max_response_bytes / 8).min(PAGE_MAX_BYTES)
}

/// The call's timeout: a long poll may legitimately take `long_poll_ms` before it answers; a
/// dump (the whole cache) gets `dump_timeout_ms`.
pub fn call_timeout_ms(events: &EventsConfig, kind: CallKind) -> u64 {
    match kind {
        CallKind::Events { .. } => events.timeout_ms.saturating_add(events.long_poll_ms),
        CallKind::Dump => events.dump_timeout_ms,
    }
}

/// What to do with a reply before its body is copied into the VM.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Disposition {
    /// No response (connect failure, timeout: no headers) or a status other than 200.
    Failed,
    /// Over `events.max_response_bytes`: rejected unread.
    TooLarge {
        body_bytes: usize,
    },
    Read,
}

/// Decides from the reply's status and announced body size alone, so an oversized page is
/// never copied out of Envoy.
pub fn disposition(
    status: Option<&str>,
    body_bytes: usize,
    max_response_bytes: usize,
) -> Disposition {
    if status != Some("200") {
        Disposition::Failed
    } else if body_bytes > max_response_bytes {
        Disposition::TooLarge { body_bytes }
    } else {
        Disposition::Read
    }
}

/// Events were lost between `after` and the page: the worker no longer buffers `after + 1`, or
/// its ids went backwards (it restarted), or the page skips ids. Never overflows: a cursor with
/// no successor (`u64::MAX`, which page validation refuses anyway) reads as a gap.
pub fn is_gap(page: &EventPage, after: u64) -> bool {
    let Some(next) = after.checked_add(1) else {
        return true;
    };
    if page.first_event_id.is_some_and(|first| first > next) || page.last_event_id < after {
        return true;
    }
    let mut expected = next;
    for e in page.events.iter().filter(|e| e.event_id > after) {
        if e.event_id != expected {
            return true;
        }
        expected = expected.saturating_add(1);
    }
    false
}

/// How a call ended, as the adapter saw it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReplyOutcome {
    /// No usable answer (transport failure, non-200).
    Failed,
    /// The page or dump was refused (oversized, malformed, wrong block size, absurd ids).
    Rejected,
    /// The page shows lost events; the adapter asks for the dump at once.
    Gap,
    /// Applied to the log.
    Applied { new_events: bool, more: bool },
}

/// When the worker is polled next (what [`PollSchedule::replied`] decided).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Next {
    /// Now (the adapter may send it from the reply callback).
    Now,
    After {
        ms: u64,
    },
    /// After a rejection backoff of `ms` (the n-th rejection in a row).
    Backoff {
        ms: u64,
        rejections: u32,
    },
}

#[derive(Clone, Copy, Debug, Default)]
struct InFlight {
    kind: Option<CallKind>,
    since_ms: u64,
    timeout_ms: u64,
}

#[derive(Clone, Copy, Debug, Default)]
struct WorkerPoll {
    in_flight: Option<InFlight>,
    next_due_ms: u64,
    rejections: u32,
    /// Gaps seen since the last applied page.
    gaps_since_page: u32,
    /// A gap was seen and no dump applied since: the next call is the dump.
    dump_wanted: bool,
}

/// Per-worker poll state of this VM's poller.
#[derive(Debug, Default)]
pub struct PollSchedule {
    workers: Vec<WorkerPoll>,
}

impl PollSchedule {
    pub fn new(workers: usize) -> PollSchedule {
        PollSchedule {
            workers: vec![WorkerPoll::default(); workers],
        }
    }

    /// No call in flight (or the one in flight is lost) and its time has come.
    pub fn is_due(&self, worker: u16, now_ms: u64) -> bool {
        let Some(w) = self.workers.get(usize::from(worker)) else {
            return false;
        };
        let busy = w.in_flight.is_some_and(|c| {
            now_ms.saturating_sub(c.since_ms) < c.timeout_ms.saturating_add(LOST_CALL_MARGIN_MS)
        });
        !busy && w.next_due_ms <= now_ms
    }

    /// Carries on a backoff another poller recorded in the shared head: no call before
    /// `until_ms`, and the next rejection backs off from `rejections` on.
    pub fn adopt_backoff(&mut self, worker: u16, until_ms: u64, rejections: u32) {
        if let Some(w) = self.workers.get_mut(usize::from(worker)) {
            w.next_due_ms = w.next_due_ms.max(until_ms);
            w.rejections = w.rejections.max(rejections);
        }
    }

    /// Forgets everything about the worker (a new host took its membership entry): no call in
    /// flight, due now, no backoff, no gap history.
    pub fn reset(&mut self, worker: u16) {
        if let Some(w) = self.workers.get_mut(usize::from(worker)) {
            *w = WorkerPoll::default();
        }
    }

    /// The worker's next call must be its dump (it showed a gap the dump has not closed yet).
    pub fn wants_dump(&self, worker: u16) -> bool {
        self.workers
            .get(usize::from(worker))
            .is_some_and(|w| w.dump_wanted)
    }

    /// Workers that are due, in order.
    pub fn due(&self, now_ms: u64) -> Vec<u16> {
        (0..self.workers.len())
            .filter_map(|w| u16::try_from(w).ok())
            .filter(|w| self.is_due(*w, now_ms))
            .collect()
    }

    pub fn sent(&mut self, worker: u16, kind: CallKind, timeout_ms: u64, now_ms: u64) {
        if let Some(w) = self.workers.get_mut(usize::from(worker)) {
            w.in_flight = Some(InFlight {
                kind: Some(kind),
                since_ms: now_ms,
                timeout_ms,
            });
        }
    }

    /// The host refused to send the call: try again after the interval.
    pub fn send_failed(&mut self, worker: u16, events: &EventsConfig, now_ms: u64) {
        if let Some(w) = self.workers.get_mut(usize::from(worker)) {
            w.in_flight = None;
            w.next_due_ms = now_ms.saturating_add(events.poll_interval_ms);
        }
    }

    /// Records a reply to the worker's call in flight and schedules its next poll.
    pub fn replied(
        &mut self,
        worker: u16,
        outcome: ReplyOutcome,
        events: &EventsConfig,
        now_ms: u64,
    ) -> Next {
        let Some(w) = self.workers.get_mut(usize::from(worker)) else {
            return Next::After {
                ms: events.poll_interval_ms,
            };
        };
        let call = w.in_flight.take().unwrap_or_default();
        let held_ms = now_ms.saturating_sub(call.since_ms);
        let interval = events.poll_interval_ms;
        let backoff = |w: &mut WorkerPoll| {
            w.rejections = w.rejections.saturating_add(1);
            let factor = 1u64.checked_shl(w.rejections.min(32)).unwrap_or(u64::MAX);
            let ms = interval
                .saturating_mul(factor)
                .min(MAX_BACKOFF_MS.max(interval));
            Next::Backoff {
                ms,
                rejections: w.rejections,
            }
        };
        let next = match outcome {
            ReplyOutcome::Failed => Next::After { ms: interval },
            ReplyOutcome::Rejected => backoff(w),
            ReplyOutcome::Gap => {
                w.dump_wanted = true;
                w.gaps_since_page = w.gaps_since_page.saturating_add(1);
                if w.gaps_since_page > 1 {
                    // The dump did not close the gap: asking for it again at once would loop.
                    backoff(w)
                } else {
                    Next::Now
                }
            }
            ReplyOutcome::Applied { new_events, more } => {
                let dump = call.kind == Some(CallKind::Dump);
                // Only a page proves the worker healthy again: a dump that does not close a
                // gap must not restart the backoff.
                if dump {
                    w.dump_wanted = false;
                } else {
                    w.rejections = 0;
                    w.gaps_since_page = 0;
                }
                let long = events.long_poll_ms > 0;
                let held_full = held_ms.saturating_mul(2) >= events.long_poll_ms;
                if (more && new_events) || (long && (dump || new_events || held_full)) {
                    Next::Now
                } else {
                    Next::After { ms: interval }
                }
            }
        };
        w.next_due_ms = match next {
            Next::Now => now_ms,
            Next::After { ms } | Next::Backoff { ms, .. } => now_ms.saturating_add(ms),
        };
        next
    }
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
    use crate::events::{IndexEvent, NumberedEvent, MAX_EVENT_ID};

    fn events(long_poll_ms: u64) -> EventsConfig {
        EventsConfig {
            poll_interval_ms: 100,
            timeout_ms: 1000,
            long_poll_ms,
            ..EventsConfig::default()
        }
    }

    #[test]
    fn a_declaration_between_polls_goes_when_the_bookings_moved_one_at_a_time() {
        let events = EventsConfig::default();
        let booked = |requests, prefill_tokens| Booked {
            requests,
            prefill_tokens,
            decode_blocks: 3.0,
            timing: None,
        };
        let timed = Booked {
            timing: Some(crate::events::TimingSums::from([
                1.0, 0.5, 0.25, 1.0, 2.0, 4.0, 1.0,
            ])),
            ..booked(1, 512.0)
        };
        assert_eq!(
            declare_path(&events, 0xabc, &timed).as_deref(),
            Some("/kv/declare?router=0000000000000abc&booked=1,512,3.0&timing=1,0.5,0.25,1,2,4,1")
        );
        let off = EventsConfig {
            declare_path: String::new(),
            ..EventsConfig::default()
        };
        assert_eq!(declare_path(&off, 1, &timed), None);
        let mut d = Declarations::default();
        assert!(
            !d.due(0, &booked(1, 0.0)),
            "the bridge has not heard of us yet"
        );
        d.sent(0, booked(0, 0.0), false);
        assert!(!d.due(0, &booked(0, 0.0)));
        assert!(d.due(0, &booked(1, 4096.0)));
        d.sent(0, booked(1, 4096.0), true);
        assert!(
            !d.due(0, &booked(2, 8192.0)),
            "one call in flight at a time"
        );
        d.answered(0, Some("204"));
        assert!(d.due(0, &booked(2, 8192.0)));
        assert!(!d.due(0, &booked(1, 4000.0)), "as last declared");
        assert!(!d.due(5, &booked(9, 0.0)), "an unknown worker");
        // An event endpoint that is not kv-event-bridge is not asked again.
        d.sent(0, booked(2, 8192.0), true);
        d.answered(0, Some("404"));
        assert!(!d.due(0, &booked(5, 0.0)));
        // ... until the entry has a new occupant, heard from with a poll.
        d.forget(0);
        assert!(!d.due(0, &booked(5, 0.0)));
        d.sent(0, booked(0, 0.0), false);
        assert!(d.due(0, &booked(5, 0.0)));
        // No answer (a timeout) is not a missing path.
        d.sent(0, booked(5, 0.0), true);
        d.answered(0, None);
        assert!(d.due(0, &booked(1, 0.0)));
    }

    #[test]
    fn a_new_poller_carries_on_the_backoff_recorded_in_the_head() {
        let cfg = events(0);
        // The previous poller saw 3 refusals and set the next fetch 800 ms out.
        let mut s = PollSchedule::new(1);
        s.adopt_backoff(0, 10_800, 3);
        assert!(!s.is_due(0, 10_799), "no fetch before the recorded time");
        assert!(s.is_due(0, 10_800));
        // The next refusal doubles from there instead of restarting at the interval.
        match call(&mut s, &cfg, DUMP, 10_800, ReplyOutcome::Rejected, 10_801) {
            Next::Backoff { ms, rejections } => assert_eq!((ms, rejections), (1600, 4)),
            other => panic!("expected a backoff, got {other:?}"),
        }
    }

    const EV: CallKind = CallKind::Events { after: 5 };
    const DUMP: CallKind = CallKind::Dump;

    fn applied(new_events: bool, more: bool) -> ReplyOutcome {
        ReplyOutcome::Applied { new_events, more }
    }

    /// Sends a call of `kind` at `sent` and replies `outcome` at `at`.
    fn call(
        s: &mut PollSchedule,
        cfg: &EventsConfig,
        kind: CallKind,
        sent: u64,
        outcome: ReplyOutcome,
        at: u64,
    ) -> Next {
        s.sent(0, kind, call_timeout_ms(cfg, kind), sent);
        s.replied(0, outcome, cfg, at)
    }

    #[test]
    fn long_poll_paths_and_timeouts() {
        let plain = events(0);
        assert_eq!(
            call_path(&plain, EV, None),
            "/kv/events?after=5&limit=10000&max_bytes=131072"
        );
        assert_eq!(call_timeout_ms(&plain, EV), 1000);
        let long = events(3000);
        assert_eq!(
            call_path(&long, EV, None),
            "/kv/events?after=5&limit=10000&max_bytes=131072&wait_ms=3000"
        );
        assert_eq!(
            call_timeout_ms(&long, EV),
            4000,
            "the wait plus the usual timeout"
        );
        assert_eq!(call_path(&long, DUMP, None), "/kv/dump");
        let booked = Booked {
            requests: 2,
            prefill_tokens: 4096.0,
            decode_blocks: 12.25,
            timing: None,
        };
        assert_eq!(
            call_path(&plain, EV, Some((0xabc, booked))),
            "/kv/events?after=5&limit=10000&max_bytes=131072&router=0000000000000abc&booked=2,4096,12.2"
        );
        assert_eq!(call_path(&long, DUMP, Some((1, booked))), "/kv/dump");
        assert_eq!(
            call_timeout_ms(&long, DUMP),
            10_000,
            "dumps do not wait, and have their own timeout"
        );
    }

    #[test]
    fn one_long_poll_in_flight_per_worker_until_it_returns() {
        let cfg = events(3000);
        let mut s = PollSchedule::new(2);
        assert_eq!(s.due(0), vec![0, 1]);
        s.sent(0, EV, call_timeout_ms(&cfg, EV), 0);
        // Held by the worker for the whole wait: never a second call meanwhile, even at every
        // tick past the plain poll interval.
        for now in (0..4000).step_by(50) {
            assert!(!s.is_due(0, now), "in flight at {now} ms");
            assert!(s.is_due(1, now));
        }
        // An event arrives at 1234 ms: the worker answers and is due again at once.
        assert_eq!(s.replied(0, applied(true, false), &cfg, 1234), Next::Now);
        assert!(s.is_due(0, 1234));
        // No event for the whole wait: the empty page also re-issues at once.
        assert_eq!(
            call(&mut s, &cfg, EV, 1234, applied(false, false), 4234),
            Next::Now
        );
    }

    #[test]
    fn after_a_dump_the_first_long_poll_goes_out_at_once() {
        let cfg = events(3000);
        let mut s = PollSchedule::new(1);
        assert_eq!(
            call(&mut s, &cfg, DUMP, 0, applied(false, false), 5),
            Next::Now
        );
    }

    #[test]
    fn an_endpoint_that_does_not_hold_calls_is_polled_at_the_interval() {
        let cfg = events(3000);
        let mut s = PollSchedule::new(1);
        // An empty page after 3 ms: the worker ignores wait_ms.
        assert_eq!(
            call(&mut s, &cfg, EV, 0, applied(false, false), 3),
            Next::After { ms: 100 }
        );
        assert!(!s.is_due(0, 50));
        assert!(s.is_due(0, 103));
    }

    #[test]
    fn a_lost_call_frees_its_worker_after_the_call_timeout() {
        let cfg = events(3000);
        let mut s = PollSchedule::new(1);
        s.sent(0, EV, call_timeout_ms(&cfg, EV), 0);
        assert!(
            !s.is_due(0, 4999),
            "within the long poll's timeout and margin"
        );
        assert!(s.is_due(0, 5000));
    }

    #[test]
    fn plain_polling_keeps_its_interval_except_for_full_pages() {
        let cfg = events(0);
        let mut s = PollSchedule::new(1);
        let every = Next::After { ms: 100 };
        assert_eq!(call(&mut s, &cfg, EV, 0, applied(true, false), 10), every);
        assert_eq!(
            call(&mut s, &cfg, EV, 200, applied(true, true), 210),
            Next::Now
        );
        assert_eq!(
            call(&mut s, &cfg, DUMP, 300, applied(true, false), 310),
            every
        );
        // A page that claims more but carries nothing is no progress.
        assert_eq!(
            call(&mut s, &cfg, EV, 350, applied(false, true), 360),
            every
        );
        assert_eq!(
            call(&mut s, &cfg, EV, 400, ReplyOutcome::Failed, 410),
            every
        );
    }

    #[test]
    fn rejected_replies_back_off_exponentially_up_to_a_bound_and_reset_on_success() {
        let cfg = events(0);
        let mut s = PollSchedule::new(1);
        let mut waits = Vec::new();
        let mut now = 0;
        for _ in 0..12 {
            match call(&mut s, &cfg, DUMP, now, ReplyOutcome::Rejected, now + 5) {
                Next::Backoff { ms, .. } => {
                    assert!(!s.is_due(0, now + 5 + ms - 1));
                    assert!(s.is_due(0, now + 5 + ms));
                    waits.push(ms);
                    now += 5 + ms;
                }
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(
            waits,
            vec![200, 400, 800, 1600, 3200, 6400, 12800, 25600, 30000, 30000, 30000, 30000]
        );
        assert_eq!(
            call(&mut s, &cfg, DUMP, now, ReplyOutcome::Rejected, now),
            Next::Backoff {
                ms: 30000,
                rejections: 13
            }
        );
        // A dump that applies is not enough; an applied page resets the count.
        call(&mut s, &cfg, DUMP, now, applied(false, false), now);
        assert_eq!(
            call(&mut s, &cfg, DUMP, now, ReplyOutcome::Rejected, now),
            Next::Backoff {
                ms: 30000,
                rejections: 14
            }
        );
        call(&mut s, &cfg, EV, now, applied(false, false), now);
        assert_eq!(
            call(&mut s, &cfg, DUMP, now, ReplyOutcome::Rejected, now),
            Next::Backoff {
                ms: 200,
                rejections: 1
            }
        );
    }

    /// A gap asks for the dump at once. A worker whose dump does not close its gap (its dump's
    /// last id is older than its buffer) would loop page -> gap -> dump -> page at network
    /// speed: the repeated gap backs off, and the call after the backoff is the dump again.
    #[test]
    fn a_gap_that_the_dump_did_not_close_backs_off() {
        for long_poll_ms in [0, 3000] {
            let cfg = events(long_poll_ms);
            let mut s = PollSchedule::new(1);
            // Right after a dump, a first gap (the worker lost events since): the dump at once.
            call(&mut s, &cfg, DUMP, 0, applied(true, false), 0);
            assert!(!s.wants_dump(0));
            assert_eq!(call(&mut s, &cfg, EV, 0, ReplyOutcome::Gap, 1), Next::Now);
            assert!(s.wants_dump(0));
            let mut now = 1;
            let mut waits = Vec::new();
            for _ in 0..3 {
                call(&mut s, &cfg, DUMP, now, applied(true, false), now);
                assert!(!s.wants_dump(0));
                match call(&mut s, &cfg, EV, now, ReplyOutcome::Gap, now) {
                    Next::Backoff { ms, .. } => {
                        assert!(s.wants_dump(0), "after the backoff, the dump");
                        waits.push(ms);
                        now += ms;
                    }
                    other => panic!("{other:?}"),
                }
            }
            assert_eq!(waits, vec![200, 400, 800], "long_poll_ms {long_poll_ms}");
            // A refused dump keeps the dump wanted.
            call(&mut s, &cfg, DUMP, now, ReplyOutcome::Rejected, now);
            assert!(s.wants_dump(0));
            // A page applied after the dump: the next gap is a first one again.
            call(&mut s, &cfg, DUMP, now, applied(true, false), now);
            call(&mut s, &cfg, EV, now, applied(true, false), now);
            assert_eq!(
                call(&mut s, &cfg, EV, now, ReplyOutcome::Gap, now),
                Next::Now
            );
        }
    }

    #[test]
    fn oversized_replies_are_refused_before_their_body_is_read() {
        assert_eq!(disposition(Some("200"), 10, 10), Disposition::Read);
        assert_eq!(
            disposition(Some("200"), 11, 10),
            Disposition::TooLarge { body_bytes: 11 }
        );
        assert_eq!(disposition(Some("500"), 1 << 30, 10), Disposition::Failed);
        assert_eq!(disposition(None, 0, 10), Disposition::Failed);
    }

    fn page(first: Option<u64>, last: u64, ids: &[u64]) -> EventPage {
        EventPage {
            worker: None,
            invalid_worker: None,
            block_size: 4,
            first_event_id: first,
            last_event_id: last,
            events: ids
                .iter()
                .map(|&event_id| NumberedEvent {
                    event_id,
                    event: IndexEvent::Cleared { dp_rank: None },
                })
                .collect(),
            load: None,
        }
    }

    #[test]
    fn gaps_are_found_without_overflow() {
        assert!(!is_gap(&page(Some(1), 7, &[6, 7]), 5));
        assert!(!is_gap(&page(Some(1), 5, &[]), 5));
        assert!(
            is_gap(&page(Some(7), 8, &[7, 8]), 5),
            "6 no longer buffered"
        );
        assert!(is_gap(&page(Some(1), 8, &[6, 8]), 5), "7 skipped");
        assert!(is_gap(&page(Some(1), 3, &[]), 5), "ids went backwards");
        // A cursor with no successor (a worker once claimed u64::MAX): a gap, not a wrap to 0.
        assert!(is_gap(&page(Some(1), u64::MAX, &[]), u64::MAX));
        // The largest valid cursor still has a successor: an idle worker there is no gap.
        assert!(!is_gap(&page(Some(1), MAX_EVENT_ID, &[]), MAX_EVENT_ID));
    }
}
